"""Reading what zerojax adds to an error it lets through."""


def zerojax_note(error: BaseException) -> str:
  """The one note zerojax added to `error` (JAX may add its own notes around it)."""
  notes = [n for n in getattr(error, '__notes__', ()) if n.startswith('zerojax')]
  assert len(notes) == 1, f'expected one note from zerojax, got {getattr(error, "__notes__", None)}'
  return notes[0]
