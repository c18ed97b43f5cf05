"""kvbranch sdk."""
