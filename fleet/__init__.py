"""What every part of Fleet Gateway shares: config, the line protocol, the policy."""

__version__ = "0.1.0"
