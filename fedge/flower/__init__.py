"""fedge's adapters to Flower: the one module touching its internals, the Grid base, the node runner.

``compat``   serialization, task identity and ``Run`` (Flower's private API, wrapped once, contract-tested)
``grid``     :class:`RunGrid`, what every fedge Grid shares
``node``     running a ClientApp for one node (Context, error replies), for the local engine and the agent
"""
