"""What the bench harness and the doctor both reckon with: request lengths and the machine's limits."""
