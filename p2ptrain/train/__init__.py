"""The trainer: model, data, the FSDP2 inner loop and the DiLoCo outer step."""
