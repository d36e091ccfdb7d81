"""Where :class:`~controller.state.ControllerState` lives between ticks and across restarts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

import structlog

from controller.atomic import write_json_atomic
from controller.errors import ConfigError
from controller.state import ControllerState

log = structlog.get_logger("sd_controller.state")


class StateStore(Protocol):
    """What the controller relies on: ``load`` once at start (by whoever builds the
    controller), ``save`` after every tick and before every hook request, so a restarted
    controller keeps its dwell clock, its pending lock and the last measured acceptance."""

    def load(self) -> ControllerState:
        """The saved state, or a fresh one when there is none."""
        ...

    def save(self, state: ControllerState) -> None:
        """Persist ``state``; raises OSError when it cannot (the tick fails, and says so)."""
        ...


class MemoryStateStore:
    """For tests, simulations and backtests."""

    def __init__(self, state: ControllerState | None = None) -> None:
        self.state = state or ControllerState()

    def load(self) -> ControllerState:
        return self.state

    def save(self, state: ControllerState) -> None:
        self.state = state


class FileStateStore:
    """A JSON file written atomically (temp file + fsync + rename).

    A corrupt file is reported and set aside (renamed ``*.corrupt-<time>``), never silently
    trusted: the controller starts fresh and learns the applied state from the hook.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.set_aside: Path | None = None

    def load(self) -> ControllerState:
        """The saved state; ConfigError (one line) when the file cannot be read or set aside."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return ControllerState()
        except OSError as exc:  # a directory, no permission
            raise ConfigError(f"setting state_file: {self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            # Not UTF-8, nested beyond the parser's depth, wrong shape: all corrupt alike.
            return ControllerState.from_dict(json.loads(raw.decode("utf-8")))
        except (
            ValueError,
            TypeError,
            RecursionError,
            ArithmeticError,
        ) as exc:  # JSONDecodeError, UnicodeDecodeError; a 400-digit integer overflows a float
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError as err:
                raise ConfigError(
                    f"setting state_file: {self.path} is corrupt and cannot be set aside: {err.strerror or err}"
                ) from None
            self.set_aside = aside
            log.error(
                "state_file_corrupt",
                path=str(self.path),
                moved_to=str(aside),
                error=f"{type(exc).__name__}: {exc}"[:200],
            )
            return ControllerState()

    def save(self, state: ControllerState) -> None:
        write_json_atomic(self.path, state.to_dict())
