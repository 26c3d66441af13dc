"""OpenAI-style batches over the fleet: the input and output line formats (`format`),
their state in Redis (`store`) and the driver that feeds a batch's lines to the fleet
under backpressure and collects their results (`driver`)."""
