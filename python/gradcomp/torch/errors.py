"""One style for every error gradcomp.torch raises.

A message starts with ``gradcomp: ``, says what was wrong in the caller's own names and
values, and what is allowed (``gradcomp: density = 2 is not allowed; allowed: 0 < density <=
1``). The C++ side (the policy registry, the bucket engine) writes the same prefix, so a
message that already starts with ``gradcomp`` goes as it is.
"""

PREFIX = "gradcomp: "


def is_gradcomps(text: str) -> bool:
    """Whether gradcomp (Python or C++) wrote this message."""
    return text.startswith("gradcomp")


def ours(text: str) -> str:
    """text with gradcomp's prefix, added only where it has none."""
    return text if is_gradcomps(text) else PREFIX + text


def for_future(error: BaseException) -> str:
    """The text a failed hook future carries: gradcomp's own messages as they are; another
    error keeps its type's name ('KeyError: ...'), so that the caller sees what it was."""
    text = str(error)
    if is_gradcomps(text):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
