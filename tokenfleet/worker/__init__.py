"""The worker: a pure continuous-batching scheduler, the engine that runs it with
the model, the Redis loop (pull -> admit -> tick -> publish -> finish), telemetry
and crash recovery."""
