"""A few counts over the last few seconds, in a ring of one-second cells: a replica's attempts, failures and
refusals for load (health.py). Constant memory and O(window) per read,
whatever the rate; a cell is cleared when the ring comes round to it again.
"""
from __future__ import annotations


class Window:
    __slots__ = ("cells", "second")

    def __init__(self, seconds: float, width: int = 3) -> None:
        self.cells = [[0] * width for _ in range(max(1, int(seconds + 0.999)))]
        self.second = 0

    def cell(self, now: float) -> list[int]:
        """The current second's counts (the ring moved on to `now`)."""
        second = int(now)
        cells = self.cells
        if second != self.second:
            for s in range(max(self.second + 1, second - len(cells) + 1), second + 1):
                cell = cells[s % len(cells)]
                cell[:] = [0] * len(cell)
            self.second = second
        return cells[second % len(cells)]

    def totals(self, now: float) -> list[int]:
        """Each count summed over the window ending now."""
        self.cell(now)
        return [sum(column) for column in zip(*self.cells)]

    def clear(self) -> None:
        for cell in self.cells:
            cell[:] = [0] * len(cell)
