"""Deployment assets: ``prefect.yaml`` (work pools, schedules, trigger), the webhook receiver, the how-to."""
