"""Where training rows come from: a registry of data sources (``registry.py``) that chat files, the
packaged ShareGPT, synthetic rows and a feature cache join like any other (``builtin.py``); raw rows
and how they become turns (``rows.py``, ``files.py``); the pipeline's source nodes (``chat.py``,
``synthetic.py``)."""

from titan_draft.data.sources.registry import (
    DataSource,
    LoaderContext,
    get_data_source,
    loader_source,
    register_data_source,
    source_rows,
)

__all__ = ["DataSource", "LoaderContext", "get_data_source", "loader_source", "register_data_source", "source_rows"]
