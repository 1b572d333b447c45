"""The router: places each request on a target replica and a draft slot, from the registry in Redis."""
