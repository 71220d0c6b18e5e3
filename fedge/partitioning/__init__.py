"""Model partitioning across devices (planned: graph capture, cost model, planner, stage export, pipeline)."""
