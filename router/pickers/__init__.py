"""Pickers: turn scores into a ranked list of workers."""

from router.pickers.base import Picker
from router.pickers.max_score import MaxScorePicker
from router.pickers.random_pick import RandomPicker
from router.pickers.round_robin import LeastUtilisedPicker, RoundRobinPicker

__all__ = ["Picker", "MaxScorePicker", "RandomPicker", "RoundRobinPicker", "LeastUtilisedPicker"]
