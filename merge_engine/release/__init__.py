"""Releases: their layout and state, atomic publishing with a manifest, and verifying what was published.

- `state`             where releases live, what a release folder holds, what state one is in
- `publish`           staging folder -> release prefix; manifest of checksums; commit marker last
- `verify`            is a release (or a merged folder) still exactly what was published?
- `checksums`         each published file against the sha256 its manifest recorded
"""
