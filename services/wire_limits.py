"""Message sizes both ends of a channel must agree on: a client that sends or accepts less than its
server would fail calls the server takes. gRPC's own default for a received message is 4 MiB."""

# The largest bucket of an in-memory weight update (the LLMProxy's ``UpdateWeightsBucket``).
MAX_WEIGHT_BUCKET_MB = 1024
# A bucket travels in pieces of this size: every message the LLMProxy receives stays small, whoever
# sends it (a Generate's prompt is a few hundred KiB at 128k tokens).
WEIGHT_CHUNK_BYTES = 4 << 20
PROXY_MAX_MESSAGE_BYTES = 8 << 20
# The largest answer a ``Generate`` client takes: MoE routing (replay) adds layers × top_k bytes a
# position, 384 at Qwen3-30B-A3B's size, which passed gRPC's 4 MiB past 11k positions; 64 MiB is 170k.
PROXY_MAX_RESPONSE_BYTES = 64 << 20
# The largest SampleBuffer message received: a ``Put`` of groups (``PutBatcher`` sends a batch
# before it reaches PUT_BATCH_BYTES). A ``Get``'s batch, sent, may be larger.
SAMPLE_BUFFER_MAX_PUT_BYTES = 64 << 20
PUT_BATCH_BYTES = 16 << 20
SAMPLE_BUFFER_MAX_MESSAGE_BYTES = 256 << 20

# The largest answer an environment provider's gRPC client takes: an observation may show a
# prompt's 16 images of up to 4 MiB each (``sample_buffer/vision.py``) beside its text.
PROVIDER_MAX_ANSWER_BYTES = 72 << 20

# The largest body an engine's HTTP API takes but a weight bucket's (the embedded engine's BodyLimit).
ENGINE_MAX_BODY_BYTES = 16 << 20

# A stream waiting for a receive slot holds what HTTP/2 flow control let its sender send: with BDP
# probing that window grows to 16 MiB a stream (six waiting 50 MiB Puts held 97 MiB). A fixed
# window of 4 MiB a stream bounds it; loopback and LAN Puts still flow at full speed.
BOUNDED_WINDOW_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4 << 20)]
