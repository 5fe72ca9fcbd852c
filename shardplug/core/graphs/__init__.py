"""``torchdata.nodes`` graphs: read once, their rows sharded by the map-style path, their work rebuilt on each part.

* :mod:`~shardplug.core.graphs.reading`: what a graph is (:func:`~shardplug.core.graphs.reading.is_graph`) and
  what it reads (:func:`~shardplug.core.graphs.reading.read_graph`): a map-style graph, or a weighted mixture
  of them, and the refusals of what cannot be sharded from outside.
* :mod:`~shardplug.core.graphs.prepared_graphs`: the prepared loader of a graph (``prepare_graph``; a mixture's
  :class:`~shardplug.core.graphs.prepared_graphs.MixtureLoaderShard`).
* :mod:`~shardplug.core.graphs.added_nodes`: the nodes shardplug adds to a rebuilt graph (imports torchdata).
* :mod:`~shardplug.core.graphs.row_tags`: what travels beside a row through the graph's per-row work.

Above the prepared loader (a graph's keys become a :class:`~shardplug.core.loader.prepared.PreparedDataLoader`),
below the planner, which recognises a graph and hands it here.
"""
