"""The serving core every runtime shares, without Ray: the plan window (job.window: planned steps, bounded,
with backpressure), the readers of a job's stream (job.consumers), the build cache (job.builds: build-ahead
on a few threads, the CP cut, eviction) and `JobService` (job.service: plan -> build -> serve one rank's
micro-batches). docs/serving.md tells the whole story.

Nothing is imported here: a trainer that only joins a node's data plane imports job.consumers alone."""
