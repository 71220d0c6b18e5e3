"""Model partitioning: graph capture, cost model, planner, stage export, pipeline runtime."""
