"""Instruction fine-tuning of a Llama, Mistral or Qwen checkpoint with zerojax, at any ZeRO stage.

    python examples/finetune_lm.py --pretrained ~/Qwen2.5-0.5B-Instruct --data chat.jsonl \
        --stage 3 --steps 200 --seq-len 256 --export tuned/
    python examples/finetune_lm.py --compare --steps 30       # stages 0-3, a small random model
    python examples/finetune_lm.py --pretrained ~/Llama-3.2-1B-Instruct --data chat.jsonl \
        --lora 16 --qlora nf4 --pack --export adapter/             # QLoRA on packed rows

--lora R trains rank-R LoRA adapters (PEFT's initialisation: the model starts as the checkpoint)
on the projections --lora-targets names, and freezes everything else
(`zero_stage(trainable=zerojax.llama.is_adapter)`: no gradient, optimizer state or master for
the base). --qlora nf4|int8 stores the base's projections quantized (QLoRA; NF4 as bitsandbytes
stores it), each quantized as it is read. --pack packs several examples into each row
(`zerojax.llama.pack`: attention never crosses an example, rotary positions restart at each).
With --lora, --export DIR writes the adapter as a PEFT folder (`peft.PeftModel.from_pretrained`
reads it), or with --merge the base with the adapter folded in, as a full checkpoint.
Tokens per second count real tokens only (not a row's padding).

--pretrained DIR is a Hugging Face folder (config.json, model.safetensors or its shards with
model.safetensors.index.json, tokenizer.json; fetch one with the hub's own tools, e.g.
`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir ~/Qwen2.5-0.5B-Instruct`).
Its weights are read straight into the stage's layout (`zerojax.llama.load`), its text is
tokenized by its own `tokenizer.json` (`tokenizers`), and conversations are rendered with its
chat template (`tokenizer_config.json`'s `chat_template` or `chat_template.jinja`) where it has
one, else prompt and completion are joined with the end-of-text token after.

--data is JSONL, one example per line, in either common shape:
  {"prompt": "...", "completion": "..."}
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
The loss counts the completion's tokens only (the last assistant message), through
`zerojax.WeightedMean`, so it is the same at every stage, device count and micro-batch. The
last 10% is held out: its loss, perplexity and next-token accuracy on completion tokens.
Without --data, the examples are built from Python's standard library: the question "What does
`module.function` do?" and the first paragraph of its docstring as the answer (real text).

Without --pretrained the same code runs on a small random Llama-family model with a byte-level
BPE trained on the data, so the test suite runs it end to end. --export DIR writes the tuned
model in the checkpoint's own names with its config and tokenizer: transformers'
`from_pretrained(DIR)` and `zerojax.llama.load(DIR, tx)` read it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax._src.decoder import REMAT  # noqa: E402

HELDOUT = 0.1


# --- Data: conversations, the chat template, tokens and completion weights.


def read_examples(path: str) -> list[list[dict]]:
  """Each JSONL line as a conversation (a list of messages ending with the assistant's)."""
  out = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = json.loads(line)
      if 'messages' in row:
        messages = row['messages']
      elif 'prompt' in row and 'completion' in row:
        messages = [
          {'role': 'user', 'content': row['prompt']},
          {'role': 'assistant', 'content': row['completion']},
        ]
      else:
        raise ValueError(
          f'{path}:{number}: expected {{"prompt", "completion"}} or {{"messages": [...]}},'
          f' got keys {sorted(row)}.'
        )
      if not messages or messages[-1].get('role') != 'assistant':
        raise ValueError(f"{path}:{number}: the last message must be the assistant's answer.")
      out.append(messages)
  if not out:
    raise ValueError(f'{path}: no examples.')
  return out


def stdlib_examples(limit: int = 1500) -> list[list[dict]]:
  """Questions about the standard library's functions, answered by their docstrings."""
  import importlib

  out, seen = [], set()
  for name in ('os', 'os.path', 'json', 'string', 'textwrap', 'shutil', 'random', 'math',
               'functools', 'itertools', 'collections', 're', 'inspect', 'glob', 'fnmatch',
               'statistics', 'heapq', 'bisect', 'base64', 'html', 'urllib.parse', 'zipfile',
               'tarfile', 'csv', 'calendar', 'difflib', 'pathlib', 'pprint', 'copy', 'typing',
               'logging', 'argparse', 'tempfile', 'gzip', 'hashlib', 'uuid', 'secrets', 'time',
               'datetime', 'decimal', 'fractions', 'operator', 'contextlib', 'ast', 'dis',
               'tokenize', 'email.utils', 'http.cookies', 'sqlite3', 'subprocess', 'threading',
               'queue', 'sched', 'shlex', 'platform', 'locale', 'gettext', 'unicodedata'):  # fmt: skip
    module = importlib.import_module(name)
    for attr, value in sorted(vars(module).items()):
      doc = inspect.getdoc(value) if callable(value) and not attr.startswith('_') else None
      if not doc:
        continue
      answer = doc.split('\n\n')[0].replace('\n', ' ').strip()
      if 20 <= len(answer) <= 400 and answer not in seen:  # a function re-exported once
        seen.add(answer)
        out.append([
          {'role': 'user', 'content': f'What does `{name}.{attr}` do?'},
          {'role': 'assistant', 'content': answer},
        ])  # fmt: skip
  rng = np.random.default_rng(0)
  return [out[i] for i in rng.permutation(len(out))[:limit]]


@dataclasses.dataclass(frozen=True)
class Text:
  """How a checkpoint turns conversations into token ids: its tokenizer, its chat template
  (or None) and its special tokens."""

  tokenizer: object
  template: str | None
  eos: str
  bos: str | None = None

  def render(self, messages: list[dict], generation_prompt: bool) -> str:
    """The chat template applied as transformers' `apply_chat_template(tokenize=False)` does
    (jinja2, blocks trimmed)."""
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=['jinja2.ext.loopcontrols']
    )

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env.globals['raise_exception'] = raise_exception
    return env.from_string(self.template).render(
      messages=messages,
      add_generation_prompt=generation_prompt,
      bos_token=self.bos or '',
      eos_token=self.eos,
    )

  def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, 1 for each token of the last assistant message and its end, else 0)."""
    ids = lambda text, special: self.tokenizer.encode(text, add_special_tokens=special).ids
    if self.template is not None:
      prompt = self.render(messages[:-1], True)
      full = self.render(messages, False)
      if not full.startswith(prompt):
        raise ValueError('the chat template does not render the prompt as a prefix of the chat.')
      head, tail = ids(prompt, False), ids(full[len(prompt) :], False)
    else:
      prompt = '\n\n'.join(m['content'] for m in messages[:-1]) + '\n\n'
      head, tail = ids(prompt, True), ids(messages[-1]['content'], False)
      tail = tail + [self.tokenizer.token_to_id(self.eos)]
    return head + tail, [0] * len(head) + [1] * len(tail)


def checkpoint_text(folder: str) -> Text:
  """The checkpoint's tokenizer.json, chat template and special tokens; its ids are
  transformers' `AutoTokenizer`'s (a file's saved padding and truncation are not applied)."""
  from tokenizers import Tokenizer

  path = os.path.join(folder, 'tokenizer.json')
  if not os.path.exists(path):
    raise FileNotFoundError(
      f'{folder}: no tokenizer.json (the tokenizers library reads that file).'
    )
  settings = {}
  if os.path.exists(os.path.join(folder, 'tokenizer_config.json')):
    with open(os.path.join(folder, 'tokenizer_config.json')) as f:
      settings = json.load(f)
  template = settings.get('chat_template')
  if os.path.exists(os.path.join(folder, 'chat_template.jinja')):
    with open(os.path.join(folder, 'chat_template.jinja')) as f:
      template = f.read()
  token = lambda v: v.get('content') if isinstance(v, dict) else v
  eos = token(settings.get('eos_token'))
  if eos is None:
    raise ValueError(f'{folder}/tokenizer_config.json: no eos_token to end each completion with.')
  tokenizer = Tokenizer.from_file(path)
  # transformers' save_pretrained writes the padding and truncation of the last call it made
  # into tokenizer.json, and its AutoTokenizer applies neither unless a call asks for them:
  # read the file as transformers does (tokenize() pads and cuts the examples itself).
  tokenizer.no_padding()
  tokenizer.no_truncation()
  return Text(tokenizer, template, eos, token(settings.get('bos_token')))


def trained_text(conversations: list[list[dict]], vocab: int) -> Text:
  """A byte-level BPE of `vocab` tokens trained on the conversations (for a random model)."""
  from tokenizers import ByteLevelBPETokenizer

  tok = ByteLevelBPETokenizer()
  texts = (m['content'] for c in conversations for m in c)
  tok.train_from_iterator(texts, vocab_size=vocab, special_tokens=['<|end|>'], show_progress=False)
  return Text(tok._tokenizer, None, '<|end|>')


def tokenize(text: Text, conversations, seq_len: int, pack: bool = False) -> dict[str, np.ndarray]:
  """'tokens' (n, seq_len + 1); 'weights' (n, seq_len) over the targets: 1 on completion
  tokens, 0 on the prompt, the padding and (packed) a target that starts another example;
  'real' (n, seq_len): 1 on the inputs that are an example's tokens. With `pack`, several
  examples per row (`zerojax.llama.pack`) and their 'segment_ids' (n, seq_len + 1); an example
  longer than seq_len + 1 is cut either way."""
  pad = text.tokenizer.token_to_id(text.eos)
  encoded = [text.encode(m) for m in common.progress(conversations, desc='tokenizing', leave=False)]
  if pack:
    pairs = [(ids[: mask.index(1)], ids[mask.index(1) :]) for ids, mask in encoded]
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')  # cutting the long examples, as the unpacked rows do
      rows = zerojax.llama.pack(pairs, seq_len, pad_id=pad)
    seg = rows['segment_ids']
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return {
      'tokens': rows['tokens'],
      'weights': rows['loss_weights'][:, 1:] * same,
      'real': (seg[:, :-1] != 0).astype(np.float32),
      'segment_ids': seg,
    }
  tokens = np.full((len(conversations), seq_len + 1), pad, np.int32)
  weights = np.zeros((len(conversations), seq_len + 1), np.float32)
  real = np.zeros((len(conversations), seq_len + 1), np.float32)
  for i, (ids, mask) in enumerate(encoded):
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    tokens[i, : len(ids)], weights[i, : len(mask)], real[i, : len(ids)] = ids, mask, 1
  return {'tokens': tokens, 'weights': weights[:, 1:], 'real': real[:, :-1]}


# --- The model, its loss and one training run.


def small_config(vocab: int, seq_len: int) -> zerojax.llama.DecoderConfig:
  """The random model trained without --pretrained: a small Llama (grouped-query attention,
  rotary embeddings, SwiGLU)."""
  return zerojax.llama.DecoderConfig(
    vocab=vocab, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256, seq_len=seq_len,
    gated=True, rope=zerojax.llama.Rope(10000.0),
  )  # fmt: skip


def token_losses(params, batch, cfg, plan, remat: str, dtype, key=None):
  """(per-token cross-entropy, hits) of the batch's targets, (batch, seq); `key`: LoRA's
  dropout (None: off, as in evaluation)."""
  tokens = batch['tokens']
  seg = batch.get('segment_ids')
  logits = zerojax.llama.logits(
    params,
    tokens[:, :-1],
    cfg,
    plan=plan,
    remat=remat,
    compute_dtype=dtype,
    dropout_key=key,
    segment_ids=None if seg is None else seg[:, :-1],
  )
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return ce, (jnp.argmax(logits, -1) == tokens[:, 1:]).astype(jnp.float32)


def train(cfg, params_fn, data, *, stage: int, steps: int, args) -> dict:
  """Trains at `stage` (the adapters alone where `cfg` has LoRA); the losses, held-out
  figures, step times, real tokens per step and memory of the run."""
  import time

  mesh = common.make_mesh()
  trainable = zerojax.llama.is_adapter if cfg.lora is not None else None
  tx = zerojax.zero_stage(optax.adamw(args.lr, weight_decay=0.0), stage, mesh=mesh,
                          stacked=cfg.stacked(), trainable=trainable)  # fmt: skip
  state = zerojax.create_train_state(lambda p: p, params_fn(tx), tx=tx)
  plan = zerojax.plan_for(tx, state.params)
  dtype = jnp.bfloat16 if args.bf16 else jnp.float32

  def loss_fn(params, batch, key):
    ce, _ = token_losses(params, batch, cfg, plan, args.remat, dtype, key)
    w = batch['weights']
    return zerojax.WeightedMean(jnp.sum(ce * w), jnp.sum(w))

  grad_fn = zerojax.value_and_grad(loss_fn, tx, per_layer=stage >= 2)

  @jax.jit
  def step(state, batch, key):
    loss, grads = grad_fn(state.params, batch, key)
    return state.apply_gradients(grads=grads), loss

  train_set, rng = data['train'], np.random.default_rng(args.seed)
  keys = jax.random.split(jax.random.key(args.seed), steps)
  batch_at = lambda: {k: v[rng.integers(0, len(v), args.batch)] for k, v in train_set.items()}
  first = batch_at()
  compiled = step.lower(state, first, keys[0]).compile()
  losses, seconds, real = [], [], []
  for i in common.progress(range(steps), desc=f'stage {stage}'):
    batch = first if i == 0 else batch_at()
    start = time.perf_counter()
    state, loss = compiled(state, batch, keys[i])
    loss = float(loss)
    seconds.append(time.perf_counter() - start)
    losses.append((i, loss))
    real.append(float(batch['real'].sum()))
  held = evaluate(state.params, data['heldout'], cfg, plan, args, dtype)
  return {'stage': stage, 'losses': losses, 'step_seconds': seconds, 'plan': plan,
          'compiled': compiled, 'params': state.params, 'real_tokens': real,
          'tokens_per_second': tokens_per_second(real, seconds), **held}  # fmt: skip


def tokens_per_second(real: list[float], seconds: list[float], warmup: int = 3) -> float:
  """Real (not padding) tokens per second over the steps after `warmup` (all, if few)."""
  at = warmup if len(seconds) > warmup else 0
  return sum(real[at:]) / sum(seconds[at:])


def evaluate(params, heldout, cfg, plan, args, dtype) -> dict:
  """Held-out loss, perplexity and next-token accuracy over completion tokens."""
  run = jax.jit(lambda p, b: token_losses(p, b, cfg, plan, 'none', dtype))
  total = hits = count = 0.0
  for batch, row_weight in common.heldout_batches(heldout, args.batch):
    ce, hit = run(params, batch)
    w = batch['weights'] * row_weight[:, None]
    total += float(jnp.sum(ce * w))
    hits += float(jnp.sum(hit * w))
    count += float(w.sum())
  loss = total / count
  return {'heldout_loss': loss, 'heldout_perplexity': float(np.exp(loss)),
          'heldout_accuracy': hits / count, 'heldout_tokens': int(count)}  # fmt: skip


# --- The command line.


def lora_config(args) -> zerojax.llama.LoraConfig | None:
  """The adapters --lora asks for (None without it)."""
  if args.lora is None:
    if args.qlora or args.merge:
      raise SystemExit('--qlora and --merge train or export LoRA adapters: give --lora R too.')
    return None
  targets = tuple(t.strip() for t in args.lora_targets.split(',') if t.strip())
  alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora
  return zerojax.llama.LoraConfig(args.lora, alpha, targets, dropout=args.lora_dropout)


def prepare(args) -> tuple:
  """(the config, a function of tx giving the parameters, the data, the text, the source)."""
  conversations = read_examples(args.data) if args.data else stdlib_examples()
  source = args.data or 'Python standard library docstrings (question -> first paragraph)'
  lora = lora_config(args)
  if args.pretrained:
    text = checkpoint_text(args.pretrained)
    cfg = zerojax.llama.config_from_hf(args.pretrained, seq_len=args.seq_len)
    cfg = dataclasses.replace(cfg, lora=lora)
    load = zerojax.llama.load
    params_fn = lambda tx: load(args.pretrained, tx, cfg=cfg, base_dtype=args.qlora)[0]
  else:
    text = trained_text(conversations, args.vocab)
    cfg = small_config(text.tokenizer.get_vocab_size(), args.seq_len)
    cfg = dataclasses.replace(cfg, lora=lora)
    params_fn = lambda tx: _random_params(cfg, tx, args.seed, args.qlora)
  arrays = tokenize(text, conversations, args.seq_len, pack=args.pack)
  train_set, heldout = common.split_heldout(arrays, HELDOUT)
  return cfg, params_fn, {'train': train_set, 'heldout': heldout}, text, source


def _random_params(cfg, tx, seed: int, qlora: str | None = None):
  """Random parameters created directly in tx's layout (the projections then quantized for
  --qlora)."""
  abstract = jax.eval_shape(lambda k: zerojax.llama.init(cfg, k), jax.random.key(seed))
  shardings = zerojax.plan_for(tx, abstract).params
  params = jax.jit(lambda k: zerojax.llama.init(cfg, k), out_shardings=shardings)(
    jax.random.key(seed)
  )
  return params if qlora is None else zerojax.llama.quantize_base(params, tx, qlora)


def export(args, cfg, params, text: Text) -> None:
  """The tuned model in the checkpoint's names, with its config and tokenizer; with LoRA the
  adapter as a PEFT folder, or (--merge) the model with the adapter folded in."""
  if cfg.lora is not None and not args.merge:
    zerojax.llama.save_adapter(params, args.export, cfg, base_model=args.pretrained)
    print(f'exported the adapter (PEFT) to {args.export}')
    return
  if cfg.lora is not None:
    params, cfg = zerojax.llama.merge_lora(params, cfg)
  zerojax.llama.save(params, args.export, cfg, source=args.pretrained)
  if args.pretrained is None and jax.process_index() == 0:  # the random model's own files
    eos = text.tokenizer.token_to_id(text.eos)
    config = zerojax.llama.to_hf_config(cfg, eos_token_id=eos, bos_token_id=eos)
    with open(os.path.join(args.export, 'config.json'), 'w') as f:
      json.dump(config, f, indent=2)
    text.tokenizer.save(os.path.join(args.export, 'tokenizer.json'))
    with open(os.path.join(args.export, 'tokenizer_config.json'), 'w') as f:
      json.dump({'eos_token': text.eos, 'tokenizer_class': 'PreTrainedTokenizerFast'}, f)
  print(f'exported to {args.export}')


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument('--pretrained', default=None, help='a Hugging Face Llama/Mistral/Qwen folder')
  p.add_argument('--data', default=None, help='JSONL of prompt/completion or messages')
  p.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3), help='ZeRO stage')
  p.add_argument('--steps', type=int, default=100, help='training steps')
  p.add_argument('--batch', type=int, default=16, help='global batch (sequences)')
  p.add_argument('--seq-len', type=int, default=128, help='tokens per sequence')
  p.add_argument('--lr', type=float, default=3e-4, help='AdamW learning rate')
  p.add_argument('--remat', default='full', choices=REMAT, help='what each layer recomputes')
  p.add_argument('--bf16', action='store_true', help='bf16 matmuls (fp32 parameters)')
  p.add_argument('--vocab', type=int, default=512, help='without --pretrained: BPE size')
  p.add_argument('--seed', type=int, default=0, help='batch order and random initialisation')
  p.add_argument('--devices', type=int, default=8, help='CPU only: how many devices to fake')
  p.add_argument('--compare', action='store_true', help='stages 0-3 on the same data and seed')
  p.add_argument('--out', default='finetune_lm_out', help='where --compare writes')
  p.add_argument('--export', default=None, help='write the tuned model to this folder')
  p.add_argument('--lora', type=int, default=None, metavar='R', help='train rank-R adapters')
  p.add_argument('--lora-alpha', type=float, default=None, help="LoRA's alpha (default 2R)")
  p.add_argument('--lora-dropout', type=float, default=0.0, help="dropout on the adapters' input")
  p.add_argument('--lora-targets', default='q,k,v,o,gate,up,down',
                 help='the projections with adapters')  # fmt: skip
  p.add_argument('--qlora', default=None, choices=('nf4', 'int8'), help='quantized base')
  p.add_argument('--pack', action='store_true', help='several examples per row')
  p.add_argument('--merge', action='store_true', help='--export the merged model, not the adapter')
  return p


def stage_row(out: dict) -> dict:
  """`common.stage_row`'s figures, the held-out perplexity and the real tokens per second."""
  extra = {
    'heldout_perplexity': out['heldout_perplexity'],
    'tokens_per_second': out['tokens_per_second'],
  }
  return common.stage_row(out) | extra


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  cfg, params_fn, data, text, source = prepare(args)
  shapes = jax.eval_shape(lambda: zerojax.llama.init(cfg, jax.random.key(0)))
  n = sum(x.size for x in jax.tree.leaves(shapes))
  trained = n
  if cfg.lora is not None:
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    trained = sum(x.size for path, x in leaves if zerojax.llama.is_adapter(path))
  rows = 'packed rows' if args.pack else 'examples'
  print(f'model: {n:,} parameters ({trained:,} trained), {cfg.n_layers} layers;'
        f' {len(data["train"]["tokens"])} training and {len(data["heldout"]["tokens"])} held-out'
        f' {rows}; data: {source}')  # fmt: skip
  stages = (0, 1, 2, 3) if args.compare else (args.stage,)
  runs = [train(cfg, params_fn, data, stage=s, steps=args.steps, args=args) for s in stages]
  for r in runs:
    print(f'stage {r["stage"]}: training loss {r["losses"][0][1]:.4f} -> {r["losses"][-1][1]:.4f};'
          f' held-out loss {r["heldout_loss"]:.4f}, perplexity {r["heldout_perplexity"]:.2f},'
          f' next-token accuracy {r["heldout_accuracy"]:.1%} over {r["heldout_tokens"]} completion'
          f' tokens; {common.median_step_seconds(r) * 1e3:.1f} ms/step (median),'
          f' {r["tokens_per_second"]:,.0f} real tokens/s')  # fmt: skip
  if args.compare:
    task = dataclasses.make_dataclass('T', ['name', 'batch'])('finetune_lm', args.batch)
    loaded = common.Data({}, {}, source, synthetic=False)
    record = common._record(task, loaded, args.steps, 0.0, num_params=n,
                            stages=[stage_row(r) for r in runs])  # fmt: skip
    common._write(record, os.path.join(args.out, 'finetune_lm_stages'), common.stage_table,
                  common.plot_stages)  # fmt: skip
    print(common.stage_table(record))
    print(f'wrote {os.path.join(args.out, "finetune_lm_stages")}.{{json,md,png}}')
  if args.export:
    export(args, cfg, runs[-1]['params'], text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
