"""Train agents written against the OpenAI API: an OpenAI-compatible endpoint per episode
whose calls are token-exact turns (docs/openai-agents.md)."""

from asyncroll.agents.server import Agent, AgentEndpoint, agent_reward
from asyncroll.agents.wire import ApiError

__all__ = ["Agent", "AgentEndpoint", "ApiError", "agent_reward"]
