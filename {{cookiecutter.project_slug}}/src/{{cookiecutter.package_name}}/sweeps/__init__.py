"""Multiruns: the guard, the summary of a sweep and its report."""
