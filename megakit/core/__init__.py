"""The pure core, no torch: the model description, the rank layout and layer partition, pipeline
schedules and their simulator, and the planner's arithmetic. Everything above builds on it."""
