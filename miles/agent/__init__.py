"""Agentic rollouts: token-exact multi-turn sessions, tool calling and tools."""
