"""Serving: the internal round services (draft, verifier) over gRPC, the session store that
bounds their memory, and a local coordinator that drives them; Ray Serve deployments build on
these."""
