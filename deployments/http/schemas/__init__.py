"""HTTP schemas (Ingress replica): the API's request and response bodies and its error answers:
`answers`, `completions`, `errors`, `openapi_errors` (the OpenAPI document's error answers)."""
