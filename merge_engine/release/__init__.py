"""Releases: their layout and state, atomic publishing with a manifest, and verifying what was published.

- `folders`           where releases live and the names inside a release folder
- `manifest`          a release's manifest and the marker holding its sha256 (`is_released`)
- `provenance`        `ReleaseProvenance`: where a release came from, as its manifest records it
- `state`             what state a release is in, and what the pipeline asks it
- `staging`           staging folders: names stable per release and fingerprint, the sweep of stale ones
- `built`             `BuiltOutput`: an output built for a release
- `publish`           staging folder -> release prefix; manifest of checksums; commit marker last
- `card`              the model card (README.md) every release carries, written with huggingface_hub's ModelCard
- `hub`               push a release to the Hugging Face Hub, one revision per step, verified against its manifest
- `verify`            is a release (or a merged folder) still exactly what was published?
- `checksums`         each published file against the sha256 its manifest recorded
"""
