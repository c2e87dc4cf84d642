/* STAND-IN: an empty library named like msLeaks' kernel hook; torch_npu enables its mstx memory calls when LD_PRELOAD names it. */
