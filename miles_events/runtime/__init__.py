"""Where actors run: ``local`` (this process) or ``ray`` (placement groups, a process each)."""
