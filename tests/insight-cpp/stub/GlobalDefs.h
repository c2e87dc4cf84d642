// Stand-in for Insight's GlobalDefs.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
