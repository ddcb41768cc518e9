"""The benchmarks' figures (`kvgate bench ... --plot DIR`): one figure drawn with matplotlib's Agg backend (no
display needed), saved as a PNG, and the markdown that shows it in the section written beside it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DPI = 110
TARGET = {"linestyle": "--", "color": "tab:red", "linewidth": 0.8}  # how a target line is drawn everywhere


@contextmanager
def figure(
    picture: Path, panels: int = 1, size: tuple[float, float] = (7.5, 4.2), title: str = ""
) -> Iterator[list[Axes]]:
    """`panels` axes side by side; on leaving, the figure laid out and written to `picture` (its folder made)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    try:
        yield list(axes[0])
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        picture.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(picture, dpi=DPI)
    finally:
        plt.close(fig)


def image(picture: Path, output: Path, alt: str) -> str:
    """The markdown that shows `picture` in `output` (a path relative to the folder `output` is in)."""
    where = Path(os.path.relpath(picture.resolve(), output.resolve().parent)).as_posix()
    return f"![{alt}]({where})"
