"""Message sizes both ends of a channel must agree on: a client that sends or accepts less than its
server would fail calls the server takes. gRPC's own default for a received message is 4 MiB."""

# The largest bucket of an in-memory weight update (the LLMProxy's ``UpdateWeightsBucket``).
MAX_WEIGHT_BUCKET_MB = 1024
# The largest SampleBuffer message: a ``Put`` of groups, or a ``Get``'s batch.
SAMPLE_BUFFER_MAX_MESSAGE_BYTES = 256 << 20
