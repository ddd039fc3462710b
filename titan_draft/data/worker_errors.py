"""Errors of the data pipeline's worker thread reach the training loop, whatever their type.

torchdata's Prefetcher forwards only ``Exception`` subclasses from its thread. A ``BaseException``
that is not one (a Rust tokenizer's panic surfaces in Python as ``PanicException``, a
``BaseException``; a ``SystemExit`` from library code) ends the thread silently and the
training loop then waits on the queue forever. Two layers stop that:

- the source node turns any failure while preparing a row into a :class:`DataRowError` that
  names the row (:func:`row_error`);
- :class:`ForwardErrorsNode`, right under the Prefetcher, turns anything else into a
  :class:`DataWorkerError` and keeps it, so the loader re-raises this one-line error rather
  than torchdata's re-wrapped copy with the thread's traceback pasted into its message.
"""

from __future__ import annotations

from typing import Any, Optional

import torchdata.nodes as tn

__all__ = ["DataRowError", "DataWorkerError", "ForwardErrorsNode", "row_error"]


class DataWorkerError(RuntimeError):
    """The data pipeline failed; the message is one line naming what failed (and the row)."""


class DataRowError(DataWorkerError):
    """Preparing one row raised; the message names the row, ``__cause__`` is the original."""


def _brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def row_error(e: BaseException, where: str) -> DataRowError:
    """The error to raise (``from e``) when preparing the row ``where`` names raised ``e``."""
    return DataRowError(f"data: {where} could not be prepared: {_brief(e)}")


class ForwardErrorsNode(tn.BaseNode):
    """Passes ``source`` through unchanged (items and state), except that any exception of its
    ``next`` (``StopIteration`` aside) is re-raised as a :class:`DataWorkerError` and kept in
    :attr:`failure` for the consumer thread."""

    def __init__(self, source: tn.BaseNode):
        super().__init__()
        self.source = source
        self.failure: Optional[DataWorkerError] = None

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self.failure = None
        self.source.reset(initial_state)

    def next(self) -> Any:
        try:
            return next(self.source)
        except StopIteration:
            raise
        except BaseException as e:  # noqa: BLE001 - the point: nothing may end the thread unreported
            failure = e if isinstance(e, DataWorkerError) else DataWorkerError(f"data: the data pipeline failed: {_brief(e)}")
            if failure is not e:
                failure.__cause__ = e
            self.failure = failure
            raise failure from failure.__cause__

    def get_state(self) -> dict[str, Any]:
        # the child's state as is: the Loader state keeps the layout it had without this node
        return self.source.state_dict()
