"""``shardplug explain``: what each process gets, computed without launching anything.

``python -m shardplug explain --samples 21 --batch-size 3 --processes 2`` prints every process's
batches with their padding, ``len()``, the steps and what is dropped; ``--format svg PATH`` draws
the same (with the ``plot`` extra: ``pip install shardplug[plot]``).

Example::

    >>> from shardplug.explain import ExplainOptions, explain
    >>> [share.length for share in explain(ExplainOptions(samples=21, batch_size=3, processes=2)).epochs[0].shares]
    [4, 4]
"""

from .picture import BatchView, EpochView, ExplainError, ExplainOptions, Picture, ResumeView, Share, explain
from .text import render_text

__all__ = [
    "BatchView",
    "EpochView",
    "ExplainError",
    "ExplainOptions",
    "Picture",
    "ResumeView",
    "Share",
    "explain",
    "render_text",
]
