"""Processes and wires: servers, clients, generated stubs, the CLI. The only package that opens sockets."""
