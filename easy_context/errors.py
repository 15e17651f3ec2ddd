"""The errors a user of the command line sees, and how the CLI reports them.

Library code raises ordinary, specific exceptions (ValueError for a bad argument,
FileNotFoundError for a missing input, ...). Only ``easy_context.cli.main`` turns them into
one line, ``easy-context <command>: error: <message>``, with an exit status that says whose
move it is:

- 2, bad usage: the input has to change (argparse errors, ValueError, missing files);
- 1, a failure at run time (anything else: a crash, a NaN loss, a dead peer);
- 130, interrupted (Ctrl-C).

A spawned rank that fails comes back as one :class:`RankError`: the first rank to fail,
which is the root cause (its peers then fail on broken connections), with its exception and
traceback kept for ``--debug``.
"""

from __future__ import annotations

import pickle

USAGE = 2
FAILURE = 1
INTERRUPTED = 130

# Exceptions that mean "change your input"; FileNotFoundError and its siblings are OSErrors,
# but unlike a full disk or a dropped connection they are the user's to fix.
USAGE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)

# Types whose message reads well alone; any other type is named in front of its message
# ("KeyError: 'input_ids'" says more than "'input_ids'").
_PLAIN = USAGE_ERRORS + (RuntimeError,)


class UsageError(ValueError):
    """A command line that cannot be parsed (argparse's errors, raised instead of exiting)."""


class RankError(RuntimeError):
    """A spawned rank failed.

    ``rank``: which one (the first to fail); ``exc_type``: its exception's class name;
    ``message``: that exception's one-line description; ``traceback``: the rank's formatted
    traceback; ``original``: the exception itself when it could be pickled back, else None.
    """

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str = "",
                 original: BaseException | None = None):
        super().__init__(f"rank {rank}: {message}")
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.traceback, self.original = traceback, original

    def __reduce__(self):  # picklable, so a failure can cross process boundaries again
        return (RankError, (self.rank, self.exc_type, self.message, self.traceback, self.original))

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException, traceback: str) -> "RankError":
        try:  # a custom exception with an unusual __init__ may not survive the trip
            original = pickle.loads(pickle.dumps(exc))
        except Exception:
            original = None
        return cls(rank, type(exc).__name__, describe(exc), traceback, original)


def describe(exc: BaseException) -> str:
    """What went wrong, for a user: the message, led by the exception's type unless the type
    is a plain one (see ``_PLAIN``) or the message is empty."""
    if isinstance(exc, RankError):
        return str(exc)
    message = str(exc).strip()
    if isinstance(exc, KeyError) and exc.args:  # str(KeyError) is the repr of its key
        message = repr(exc.args[0])
    if not message:
        return type(exc).__name__
    return message if type(exc) in _PLAIN or isinstance(exc, UsageError) else \
        f"{type(exc).__name__}: {message}"


def exit_code(exc: BaseException) -> int:
    """The exit status for ``exc`` (see the module docstring); a rank's failure is judged by
    the exception that rank raised."""
    if isinstance(exc, RankError):
        return exit_code(exc.original) if exc.original is not None else FAILURE
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    return USAGE if isinstance(exc, USAGE_ERRORS) else FAILURE


def one_line(message: str, limit: int = 600) -> str:
    """A message on one line: its lines joined; a very long one (a C++ stack from torch, say)
    cut after its first line, since --debug shows the rest."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    joined = " ".join(lines)
    if len(joined) <= limit:
        return joined
    first = lines[0] if len(lines[0]) <= limit else lines[0][:limit] + "..."
    return first + " [more with --debug]"
