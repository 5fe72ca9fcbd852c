"""Hugging Face ``datasets`` for the tests, without its pause of 5 seconds after each shuffled pass.

datasets (5.x) sleeps ``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`` (5) seconds at the end of
every pass over a shuffled stream of files, "to let PyArrow close threads gracefully". The tests
read such 40-row streams dozens of times (about two minutes of sleeping on one gloo run); here that
grace is a tenth of a second. Every gloo rank and DataLoader worker of the tests imports this module
(``tests/_dist.py``'s fork server preloads it), and so does every test module that builds HF streams.
"""

from __future__ import annotations

import datasets

datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = min(datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN, 0.1)
