"""Pictures of a run: training curves, validation ROC and confusion matrix, slide heatmaps, the HTML report."""
