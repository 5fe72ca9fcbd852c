"""Imported by the fork server of DataLoader workers that read MosaicML streaming datasets: makes
``streaming.base`` importable in every worker it starts, without ``streaming``'s package
``__init__`` (see ``_stream_libraries``); nothing where streaming is not installed."""

from __future__ import annotations

from _stream_libraries import import_streaming_base

import_streaming_base()
