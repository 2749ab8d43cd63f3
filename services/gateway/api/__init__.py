"""The gateway's front ends: the OpenAI HTTP API (one module per endpoint: `completions`,
`chat`, `responses`, `tokenize`, `models`; what they share: `fields`, `format`, `respond`,
`cache_options`; the app itself: `http_app`) and the public gRPC `Generation` service
(`grpc_service`). They translate wire formats to the request core and back; imports point from
here to the core, `tools/` and `structured/`, never the other way."""
