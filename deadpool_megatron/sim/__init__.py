"""Failure simulator for long jobs at scale: what hot-swap saves over checkpoint-restart."""
