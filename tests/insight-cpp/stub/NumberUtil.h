// Stand-in for Insight's NumberUtil.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
