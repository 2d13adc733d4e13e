"""The control server (``run.control_server_port``) and the mini fault-tolerance
controller (``run.mini_ft_controller``)."""
