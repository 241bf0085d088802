"""Progress bars that read right on a terminal and in a log file alike.

On a terminal a tqdm bar redraws itself in place, with carriage returns and cursor movements. A file keeps every
redraw (SLURM's ``.out`` files, a pipe, a CI log): one unreadable line, and escape sequences. Every progress bar of
the project is made by :func:`tqdm` here, a drop-in for ``tqdm.tqdm``: tqdm's own bar where its stream (``file``,
standard error by default) is a terminal, else :class:`LineBar`, the same bar written as whole lines, not too often.
The training display (``robust_lightning.training.progress``) picks its form by the same test, :func:`is_terminal`.
"""

import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm as _tqdm

if TYPE_CHECKING:  # types-tqdm's tqdm is generic in what its iterable yields; tqdm's own class is not
    _Bar = _tqdm[Any]
else:
    _Bar = _tqdm

LINE_INTERVAL = 30.0  # seconds: a LineBar writes a line at most this often between its first and its last


def is_terminal(stream: Any = None) -> bool:
    """Whether ``stream`` (default: standard error) is a terminal; False for a file, a pipe, a closed stream, None."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty (a replaced stream), or closed
        return False


class LineBar(_Bar):
    """A tqdm bar written as whole lines (no bar, no carriage return, no escape sequence), each the text tqdm shows:
    ``autoattack:  50% 2/4 [00:12<00:12,  6.00s/attack, apgd-t]``. A line at the first step, then at most one every
    ``interval`` seconds, one when the count reaches the total, and at close one for steps not yet written (at
    tqdm's overall rate)."""

    clock = staticmethod(time.monotonic)  # what the interval is measured with

    def __init__(self, *args: Any, interval: float = LINE_INTERVAL, **kwargs: Any):
        self._interval = interval
        self._written_n: float | None = None  # the count the last line showed (None: no line yet)
        self._written_at = 0.0
        kwargs["ncols"] = 0  # tqdm's text without the bar
        kwargs.pop("dynamic_ncols", None)
        super().__init__(*args, **kwargs)

    def _write_line(self) -> None:
        self.fp.write(f"{self}\n")
        self.fp.flush()
        self._written_n, self._written_at = self.n, self.clock()

    # True as tqdm's own display returns (types-tqdm declares None)
    def display(self, msg: str | None = None, pos: int | None = None) -> bool:  # type: ignore[override]
        # msg: tqdm clearing the bar ('') or its "more hidden" note for nested bars, neither of which a log needs
        if msg is None and self.n > self.initial and self.n != self._written_n:
            done = self.total is not None and self.n >= self.total
            if self._written_n is None or done or self.clock() - self._written_at >= self._interval:
                self._write_line()
        return True

    def clear(self, nolock: bool = False) -> None:  # nothing is drawn, so nothing is erased (tqdm.write calls it)
        pass

    def moveto(self, n: int) -> None:  # no cursor movements
        pass

    def reset(self, total: float | None = None) -> None:
        self._written_n = None
        super().reset(total)

    def close(self) -> None:
        if not self.disable and getattr(self, "sp", None) is not None:
            if self.n > self.initial and self.n != self._written_n:
                self._ema_dt = lambda: None  # the overall rate, as tqdm shows when it leaves a bar
                self._write_line()
            self.sp = None  # tqdm's close then only unregisters the bar: no carriage return, no clearing
        super().close()


def tqdm(*args: Any, **kwargs: Any) -> _Bar:
    """``tqdm.tqdm(*args, **kwargs)`` where its stream (``file``, default standard error) is a terminal, otherwise
    the same bar as whole lines (:class:`LineBar`)."""
    stream = kwargs.get("file") or sys.stderr
    if is_terminal(stream):
        return _tqdm(*args, **kwargs)
    return LineBar(*args, **kwargs)
