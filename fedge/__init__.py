"""fedge: federated and edge learning for constrained devices.

Subpackages (dependencies point one way: compression → protocol → {server, client} → app → simulation → cli)
-------------------------------------------------------------------------------------------------------------
compression   codecs, error feedback, wire format (pure numpy)
protocol      the contract coordinator and devices speak: records, the reference step, fleet naming
flower        adapters to Flower: its internals (compat), the Grid base, the node runner
devices       device and link profiles, availability traces, the simulated clock
transport     the MQTT stack and the Flower Grid over MQTT
server        coordinator: strategies, aggregation, the round runner, checkpoints, audit, the service, exports
client        client side: the compression mod, the device agent
inference     ONNX Runtime on devices: sessions, variant selection, hot swap (no torch, no Flower)
partitioning  graph capture, cost model, planner, stage export, pipelined runner
reporting     run history, plots, console display
app           the reference Flower app and task
simulation    engines (local, Ray, MQTT) and simulated fleets
localnet      brokers and a lossy-link proxy on one machine
bench, cli    the benchmarks and the ``fedge`` command
"""

__version__ = "0.1.0"
