"""specpool's callers' side: the Target API stubs (specpool_client.v1) and a typed client."""

from specpool_client.client import (
    ErrorDetails,
    TargetClient,
    final_result,
    generate_request,
    generate_result,
)

__all__ = ["ErrorDetails", "TargetClient", "final_result", "generate_request", "generate_result"]
