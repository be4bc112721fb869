"""Statistics shared by the distribution tests."""

import numpy as np
from scipy.stats import chi2


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, pooling cells with expected count < 5 into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))
