"""Choosing the pods of a sequence: the gateway's view of the pods (`pods`), their pure scores
(`scoring`), the credit a cached block earns by its tier (`tier_credit`) and the router that
gathers the inputs from Redis and the pools (`router`). Knows nothing of requests' APIs."""
