"""fedge: federated and edge learning for constrained devices.

Subpackages
-----------
server        coordinator: strategies, aggregation, checkpoints, the coordinator service
client        client side: the compression mod, the device agent
compression   codecs, error feedback, wire format (pure numpy)
partitioning  model partitioning (planned: graph capture, cost model, planner, stage export)
transport     MQTT channel, Flower Grid over MQTT, broker helpers, lossy-link proxy
simulation    engines (local, Ray, MQTT), configuration, progress display
app           the reference Flower app and task
"""

__version__ = "0.1.0"
