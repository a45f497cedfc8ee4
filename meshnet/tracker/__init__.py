"""Tracker service: registry, coverage, placement, demand, routing, directives, store."""
