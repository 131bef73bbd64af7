"""The object-storage servers the suite runs against (SeaweedFS S3, fake-gcs-server): the product's own,
`synthetic_runs.servers` (the demo starts them too), under the names the tests import."""

from __future__ import annotations

from synthetic_runs.servers import FakeGcsServer, SeaweedS3Server, ServerStartError, applied_env, free_ports

__all__ = ["FakeGcsServer", "SeaweedS3Server", "ServerStartError", "applied_env", "free_ports"]
