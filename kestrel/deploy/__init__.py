"""Serving beyond one engine: data-parallel replicas behind a gateway (`kestrel serve --dp-size`), and
adapters for serving frameworks (Ray Serve). See docs/deployment.md."""
