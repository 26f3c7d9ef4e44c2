"""localrun's OpenAI-compatible HTTP server (`localrun serve`)."""

# Requests waiting for their first engine step past which a new one gets a 503 with Retry-After:
# four full batches at the default --parallel 16. A request further back would wait minutes on
# a desktop; its client is better told at once than left hanging.
DEFAULT_MAX_QUEUE = 64
