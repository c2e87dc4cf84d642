// Stand-in for Insight's ProtocolDefs.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
