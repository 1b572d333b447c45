"""The pooled speculation endpoint: drafters for several target models, shared by many tenants.

drafters (target model -> its drafters) · sessions (per (tenant, request id), under a lease) ·
batcher (the engine loop: one batched draft forward per step for all tenants), with streams (the
Rounds streams' queue) and prespeculation (SSD's work while targets verify) · endpoint (the domain
API the gRPC servicer wraps) · wire (protobuf <-> domain) · server (servicer and CLI).
"""
